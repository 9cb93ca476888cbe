"""lorafarm: serve thousands of per-customer LoRA adapters on one shared base model."""

__version__ = "0.1.0"

"""lorafarm archives package."""

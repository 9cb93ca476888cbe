"""lorafarm router package."""

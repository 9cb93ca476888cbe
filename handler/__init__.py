"""lorafarm handler package."""

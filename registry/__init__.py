"""lorafarm registry package."""

"""lorafarm loadtests package."""

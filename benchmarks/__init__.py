"""pytest-benchmark suites (`make bench`); not part of `make test`."""

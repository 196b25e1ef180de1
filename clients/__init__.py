"""One client per protocol, shared by the conformance suites, the benchmarks, the tests and the Spark source."""

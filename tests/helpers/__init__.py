"""Code shared by the test suites (import as `tests.helpers.<module>`)."""

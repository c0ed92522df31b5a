"""Performance measurements (issue 6 builds the harness). Never imported by tests."""

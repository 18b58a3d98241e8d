"""One-off questions: probes and A/B tools, each module's docstring opening with the question it
answers (the maintained suites sit one level up; see benchmarks/README.md)."""

"""The exactness harness: native paths against the ordered fallback, bit for bit."""
from ds4t.exactness.harness import Plan, Report, Scenario, plant, run_scenario  # noqa: F401

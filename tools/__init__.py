"""Development tools: builders of test fixtures, never imported by the serving processes."""

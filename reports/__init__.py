"""Human-facing views of committed artifacts (the data report); they read manifests and data only."""

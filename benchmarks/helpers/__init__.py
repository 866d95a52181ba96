"""What the benchmark scripts share: none of these modules is a script."""

"""The spanwarm node daemon. Imports no torch."""

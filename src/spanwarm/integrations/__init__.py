"""Integrations with loaders; each imports its framework only when used."""

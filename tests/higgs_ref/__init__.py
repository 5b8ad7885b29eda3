"""Higgs Audio v2 reference (transformers 5.x) helpers for the parity tests."""

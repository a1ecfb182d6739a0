"""Faust-independent agent logic: the inference pipeline."""

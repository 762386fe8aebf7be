"""Evaluating trained models: ``fe-eval`` (perplexity, LAMBADA, multiple choice, NIAH)."""

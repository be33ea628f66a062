"""Experiments of the paper as functions behind `lopd` commands."""

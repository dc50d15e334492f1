"""Executable specification: eager, obviously-correct pure-torch versions of every stage.

Runs on CPU; slow is fine. Every fast kernel in ``speculum.kernels`` is tested against its twin
here.
"""

"""The `eagle3` command (`main`) and `eagle3 quickstart`: the layer above every stage, kept out of the core
(`eagle3.contract`, `eagle3.dist`, ...), which the stages import and which imports none of them."""

from eagle3.cli.main import build_parser, main

__all__ = ["build_parser", "main"]

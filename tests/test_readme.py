"""The README and the generated docs say what the code does."""

from __future__ import annotations

from pipeline.tools.config_reference import COMMAND, DOC, render, undescribed


def test_configuration_reference_is_generated_from_the_code():
    assert DOC.read_text() == render(), f"docs/configuration.md is out of date: run `{COMMAND}`"


def test_every_config_key_says_what_it_does():
    assert undescribed() == [], "give these keys a Field(description=...) in pipeline/config.py"

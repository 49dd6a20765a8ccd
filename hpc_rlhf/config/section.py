"""The base of every config section (its own module so that section files besides ``schema`` can use it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys and wrong types fail loudly."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

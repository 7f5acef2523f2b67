"""FTI's constants, return codes and datatypes: ``ftidask.constants`` as documented before the package was
layered. The module is :mod:`ftidask.model.constants`; this name keeps existing imports working."""

from .model.constants import *  # noqa: F403 - the same names

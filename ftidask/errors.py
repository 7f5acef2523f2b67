"""Exceptions of ftidask: ``ftidask.errors`` as documented before the package was layered. The module is
:mod:`ftidask.model.errors`; this name keeps existing imports working (the classes are also ``ftidask.X``)."""

from .model.errors import *  # noqa: F403 - the same names

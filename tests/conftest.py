"""Plugins of the whole suite."""

pytest_plugins = ["tests.helpers.deadline"]

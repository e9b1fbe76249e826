"""Fixtures of these tests: the loopback Ray session (`tests.helpers.ray`)."""

from tests.helpers.ray import local_ray, ray_session

__all__ = ["local_ray", "ray_session"]

# The metadata lives in pyproject.toml; this file exists for tools (and
# people) that still run ``python setup.py ...`` directly.
from setuptools import setup

setup()

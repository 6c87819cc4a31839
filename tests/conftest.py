"""Test-suite wide pytest settings."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quality: eviction quality checks on the bundled model through the transformers reference "
                   "(minutes; deselect with -m 'not quality')")

"""swapformer's build backend (pyproject.toml: [build-system]): setuptools' own, except that an editable
install does not end with setuptools' notice "Editable installation. Please be careful with folders in
your working directory with the same name as your package ...".

pip shows every warning a build backend emits. That notice is information, not a fault: setuptools emits
it on every editable install it makes with an import finder, the only way it can install a layout like
this one (top-level folders mapped onto subpackages by package-dir), and it has no setting to turn it off.
Everything else setuptools says, warnings included, still reaches the user.
"""

from __future__ import annotations

import warnings

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403 (every other hook exactly as setuptools defines it)

EDITABLE_NOTICE = r"Editable installation\."


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EDITABLE_NOTICE, category=UserWarning)
        return build_meta.build_editable(wheel_directory, config_settings, metadata_directory)

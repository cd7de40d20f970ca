"""A PEP 517 build backend for traind's pure-Python client, so that `pip install ./python`
needs no setuptools or wheel from the network: the wheel is a zip of traind/ with its
.dist-info (PEP 427, PEP 566), the sdist a tar of this directory."""

import base64
import hashlib
import io
import os
import tarfile
import zipfile

NAME = "traind"
VERSION = "0.1.0"
HERE = os.path.dirname(os.path.abspath(__file__))
DIST_INFO = "%s-%s.dist-info" % (NAME, VERSION)
METADATA = """Metadata-Version: 2.1
Name: traind
Version: %s
Summary: Python client for traind, the training daemon
Requires-Python: >=3.8
Requires-Dist: msgpack>=1.0
Provides-Extra: pandas
Requires-Dist: pandas; extra == "pandas"
""" % VERSION
WHEEL = """Wheel-Version: 1.0
Generator: _traind_build
Root-Is-Purelib: true
Tag: py3-none-any
"""


def _sources():
    pkg = os.path.join(HERE, NAME)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            yield "%s/%s" % (NAME, name), os.path.join(pkg, name)


def _record_line(arc, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arc, digest, len(data))


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    d = os.path.join(metadata_directory, DIST_INFO)
    os.makedirs(d, exist_ok=True)
    for name, text in (("METADATA", METADATA), ("WHEEL", WHEEL)):
        with open(os.path.join(d, name), "w", encoding="utf-8") as f:
            f.write(text)
    return DIST_INFO


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel = "%s-%s-py3-none-any.whl" % (NAME, VERSION)
    records = []
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w", zipfile.ZIP_DEFLATED) as z:
        files = [(arc, open(path, "rb").read()) for arc, path in _sources()]
        files += [(DIST_INFO + "/METADATA", METADATA.encode()),
                  (DIST_INFO + "/WHEEL", WHEEL.encode())]
        for arc, data in files:
            z.writestr(arc, data)
            records.append(_record_line(arc, data))
        records.append(DIST_INFO + "/RECORD,,")
        z.writestr(DIST_INFO + "/RECORD", "\n".join(records) + "\n")
    return wheel


def build_sdist(sdist_directory, config_settings=None):
    base = "%s-%s" % (NAME, VERSION)
    sdist = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, sdist), "w:gz") as t:
        for rel in ["pyproject.toml", "_traind_build.py", "README.md"] + \
                   [arc for arc, _ in _sources()]:
            t.add(os.path.join(HERE, rel), arcname="%s/%s" % (base, rel))
        info = tarfile.TarInfo("%s/PKG-INFO" % base)
        data = METADATA.encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return sdist

"""What every model-file reader shares: the error a missing, malformed or unsupported file
raises (one line naming the file, never a traceback), and the JSON reader that raises it."""
from __future__ import annotations

import json


class ModelLoadError(ValueError):
    pass


def read_json(file: str):
    """A config file's JSON; malformed is a ModelLoadError naming the file, not a traceback."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from None

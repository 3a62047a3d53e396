import json

import pytest


def reports(text: str, tag: str = "REPORT") -> list[dict]:
    """The JSON lines a probe target printed, sorted by rank."""
    rows = [json.loads(line.split(tag + " ", 1)[1]) for line in text.splitlines() if tag + " " in line]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.fixture
def parse_reports():
    return reports

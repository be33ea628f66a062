"""`lopd config`: every key, its value after overrides, and its meaning."""

from __future__ import annotations

from lopd.cli.common import add_command, load
from lopd.config import describe
from lopd.tables import format_table, write_json


def cmd_config(args) -> int:
    cfg = load(args)
    values = cfg.to_dict()
    rows = []
    for key, _default, help_text in describe():
        section, name = key.split(".", 1)
        rows.append([key, repr(values[section][name]), help_text])
    print(format_table(["key", "value", "meaning"], rows, title=f"config {args.config}"))
    write_json(args.json_path, values)
    return 0


def register(sub) -> None:
    add_command(sub, "config", cmd_config, "print the resolved config with the meaning of each key",
                "Print every config key, its value after overrides, and its meaning.")

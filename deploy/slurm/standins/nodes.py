"""What the Slurm stand-ins (``srun``, ``scontrol`` beside this file) share: the job's nodes and their addresses.

The stand-ins let deploy/slurm/grpo-multinode.sbatch run unchanged on one machine, each "node" a loopback address
(127.0.0.2, 127.0.0.3, ...: Linux routes all of 127/8 to ``lo``). One variable says which nodes exist and where:

    GRPO_STANDIN_NODES="node1=127.0.0.2,node2=127.0.0.3,node3=127.0.0.4,node4=127.0.0.5"

and SLURM_JOB_NODELIST names the job's nodes as Slurm would (``node[1-4]``). Standard library only: the stand-ins
run with whatever ``python3`` is on PATH, before any venv.
"""

from __future__ import annotations

import os
import re
import sys

NODES_VAR = "GRPO_STANDIN_NODES"


class StandinError(Exception):
    """A mistake in the stand-ins' input; the message names the variable or option."""


def node_addresses() -> dict[str, str]:
    """``GRPO_STANDIN_NODES`` as {node name: address}."""
    text = os.environ.get(NODES_VAR, "")
    if not text.strip():
        raise StandinError(f"{NODES_VAR} is not set (e.g. {NODES_VAR}=node1=127.0.0.2,node2=127.0.0.3)")
    nodes = {}
    for item in text.split(","):
        name, sep, address = item.strip().partition("=")
        if not sep or not name or not address:
            raise StandinError(f"{NODES_VAR}: {item!r} is not NAME=ADDRESS")
        nodes[name] = address
    return nodes


def expand_hostlist(expression: str) -> list[str]:
    """Slurm's hostlist syntax, the common part: ``a,b,node[1-3,7],gpu[01-02]`` -> names in order."""
    names = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", expression):
        match = re.fullmatch(r"([^\[]+)\[([^\]]*)\]", part)
        if match is None:
            names.append(part)
            continue
        prefix, ranges = match.groups()
        for piece in ranges.split(","):
            low, dash, high = piece.partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise StandinError(f"hostlist {expression!r}: bad range {piece!r}")
            for number in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{number:0{len(low)}d}")
    return names


def address_of(name: str) -> str:
    nodes = node_addresses()
    if name not in nodes:
        raise StandinError(f"node {name!r} is not in {NODES_VAR} ({', '.join(nodes)})")
    return nodes[name]


def fail(tool: str, exc: Exception) -> None:
    print(f"{tool} (stand-in): error: {exc}", file=sys.stderr)
    sys.exit(2)

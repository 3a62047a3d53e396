"""Experiments that ship with ddplab, by name: `ddplab run NAME`.

Values are `module:attribute` strings so that listing names imports nothing heavy.
"""

REGISTRY: dict[str, str] = {
    "alignment_stats": "ddplab.experiments.alignment_stats:AlignmentStats",
    "bbbp": "ddplab.experiments.bbbp:BBBP",
    "smiles_lm": "ddplab.experiments.smiles_lm:SmilesLM",
    "toy": "ddplab.experiments.toy:main",
    "translation": "ddplab.experiments.translation:Translation",
}

"""GSM8K's answers and verl's strict score, for examples/grpo_math.py: a module of its own, so
the reward group's ranks import this alone, not the recipe (which loads a tokenizer and
reads the datasets at its top level)."""

import re


def ground_truth(answer: str) -> str:
    """The final answer of a GSM8K solution ("... #### 1,234" -> "1234"), or the answer."""
    return str(answer).split("####")[-1].strip().replace(",", "")


def reward(prompt, response, answer):
    """1 when the last "#### <number>" of the response is the answer (commas ignored)."""
    found = re.findall(r"#### (-?[0-9.,]+)", response)
    return float(bool(found) and found[-1].replace(",", "") == answer)

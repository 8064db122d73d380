"""A recipe's terms in the objects of the layers below, for every consumer above: training,
evaluation, sampling and serving read a recipe the same way.

  terms.py   the order policy of the method section (core), the run's data directory, how
             supervised records fill rows and how prompts are formatted (data)
"""

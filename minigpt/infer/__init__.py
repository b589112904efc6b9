"""A trained or imported model run on what a person types, for `minigpt sample` and
`minigpt inspect-heads`: which model (a run, a checkpoint of it, or a Hugging Face model) and
which prompt, with the rules between their flags checked once; and text generation, the token
loop of core/generate.py turned into printable text with stop strings and timings.
"""

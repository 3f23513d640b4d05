"""Pooling models: embeddings, classification and rerank scores from one prefill.

A pooling request runs its prompt through the model once (shared scheduler, paged KV cache, no
decode) and finishes after its prefill; a pooler turns the hidden states into one vector.
config.py reads what to pool from the checkpoint, model.py gives the decoder its head,
pooler.py pools a step's rows, params.py and outputs.py are what users pass and get back.
"""

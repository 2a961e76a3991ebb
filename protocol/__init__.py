"""What the gateway and the workers both speak (docs/design.md §1, §4): the OpenAI request and response
shapes and their validation, the prompt as token ids (tokenizer, chat template, the canonical fallback), the
KV-event schema, the Redis key names and client, and the small helpers both servers run on.

Neither side owns it: the gateway imports nothing from `workers/`, the workers nothing from
`gateway/`, and this package imports from neither. Nothing here imports torch.
"""

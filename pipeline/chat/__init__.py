"""Chat: message lists to token ids with the tokenizer's own chat template, turn bridging, tool-call parsing.

`template.ChatTemplate` renders OpenAI-style messages with the template the tokenizer ships
(``tokenizer_config.json``) or one given by file, and *bridges* a conversation from one turn to the next
without re-tokenizing what the model sampled; `literal` keeps special-token text inside messages as text (only the
template's scaffold makes turn markers); `template_budget` renders a template once under a step, memory and time
budget before it is used (in a probe process, `template_probe.py`). `tool_parsers` turns a reply's tool-call text
into OpenAI ``tool_calls``, bounded and never raising. Both the generator's endpoint and multi-turn tasks use them, so this floor sits below
`pipeline/tasks/` and knows nothing of the wire or the RL logic.
"""

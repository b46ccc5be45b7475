"""The reference engine: a Llama-family decoder over a paged KV pool.

Import from the submodules (`engine`, `sampling`, `tokenizer`, ...); this
package file stays empty so importing a pure submodule never pulls in torch.
"""

"""The HTTP APIs (OpenAI chat, completions, responses, embeddings; Anthropic messages) around what they share: sampling fields, errors, tools, output parsing."""

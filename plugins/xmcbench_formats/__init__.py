"""xmcbench's built-in data formats: the raw-text layout, CSV/TSV/JSONL, the Extreme Classification
Repository's sparse files, PECOS folders and Hugging Face `datasets` folders (docs/data-formats.md)."""

"""What a run trains on: `prompts` (prompt files and sources), `edit_sources` (editing source images), the shipped
worlds `shapes` and `scenes`."""

"""Response regeneration: the target model writes the assistant turns of chat data (``eagle-data regenerate``)."""

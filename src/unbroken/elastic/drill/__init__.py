"""The fire drill: kill a job on purpose and prove the resumed run ends where an uninterrupted one does."""

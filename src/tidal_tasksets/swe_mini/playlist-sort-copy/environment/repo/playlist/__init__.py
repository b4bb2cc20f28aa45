"""Playlists for the music player."""

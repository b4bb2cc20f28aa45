"""Line-oriented text helpers."""

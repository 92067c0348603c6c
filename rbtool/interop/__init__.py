"""Other formats: LeRobot datasets both ways."""

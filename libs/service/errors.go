package service

import "errors"

// ErrAlreadyStarted is returned by [Ops.Start] when called a second time.
var ErrAlreadyStarted = errors.New("already started")

// ErrAlreadyRun is returned by [Group.Run] when called a second time.
var ErrAlreadyRun = errors.New("group already run")

// ErrExited is returned by [Group.Run], wrapped with the component's name,
// when a component added with [Group.AddRun] returns nil before shutdown.
var ErrExited = errors.New("component exited")

package raftnode

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/stretchr/testify/require"
)

func TestBoltStore_Logs(t *testing.T) {
	t.Parallel()
	s, err := OpenBoltStore(filepath.Join(t.TempDir(), "raft.db"))
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Close()) }()

	first, err := s.FirstIndex()
	require.NoError(t, err)
	require.Zero(t, first)
	at := time.Unix(0, 1_700_000_000_123_456_789)
	var logs []*raft.Log
	for i := uint64(1); i <= 10; i++ {
		logs = append(logs, &raft.Log{Index: i, Term: 2, Type: raft.LogCommand, Data: []byte{byte(i)}, Extensions: []byte("x"), AppendedAt: at})
	}
	require.NoError(t, s.StoreLogs(logs))
	var got raft.Log
	require.NoError(t, s.GetLog(7, &got))
	require.Equal(t, *logs[6], got)
	require.ErrorIs(t, s.GetLog(11, &got), raft.ErrLogNotFound)

	require.NoError(t, s.DeleteRange(1, 4))
	first, _ = s.FirstIndex()
	last, _ := s.LastIndex()
	require.Equal(t, uint64(5), first)
	require.Equal(t, uint64(10), last)
}

func TestBoltStore_Stable(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "raft.db")
	s, err := OpenBoltStore(path)
	require.NoError(t, err)
	_, err = s.Get([]byte("missing"))
	require.EqualError(t, err, "not found", "hashicorp/raft matches this text")
	require.NoError(t, s.SetUint64([]byte("CurrentTerm"), 42))
	require.NoError(t, s.Close())

	s, err = OpenBoltStore(path)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Close()) }()
	v, err := s.GetUint64([]byte("CurrentTerm"))
	require.NoError(t, err)
	require.Equal(t, uint64(42), v)
}

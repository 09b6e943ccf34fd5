package meta

import (
	"strconv"
	"strings"
)

// Lookup returns the value at a dotted path ("a.b.0.c") inside a decoded JSON
// value; array elements are addressed by index.
func Lookup(v any, path string) (any, bool) {
	if path == "" {
		return v, true
	}
	for part := range strings.SplitSeq(path, ".") {
		switch x := v.(type) {
		case map[string]any:
			next, ok := x[part]
			if !ok {
				return nil, false
			}
			v = next
		case []any:
			i, err := strconv.Atoi(part)
			if err != nil || i < 0 || i >= len(x) {
				return nil, false
			}
			v = x[i]
		default:
			return nil, false
		}
	}
	return v, true
}

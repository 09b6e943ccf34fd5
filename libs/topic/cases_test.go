package topic

// This file holds the fixture tables shared by the unit tests, the property
// test and the fuzz seeds. Comments cite MQTT 5.0 normative statements; MQTT
// 3.1.1 numbers the wildcard rules one higher (4.7.1-2 for '#', 4.7.1-3 for
// '+') and has the no-wildcards-in-names rule as 4.7.1-1.

type matchCase struct {
	filter, topic string
	want          bool
}

var matchCases = []matchCase{
	// [MQTT-4.7.1-1] '#' matches the parent level and any number of children.
	{"sport/tennis/player1/#", "sport/tennis/player1", true},
	{"sport/tennis/player1/#", "sport/tennis/player1/ranking", true},
	{"sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", true},
	{"sport/tennis/player1/#", "sport/tennis/player2", false},
	{"sport/tennis/player1/#", "sport/tennis", false},
	{"sport/#", "sport", true},
	{"sport/#", "sport/", true},
	{"sport/#", "sports", false},
	{"sport/#", "/sport", false},
	{"#", "sport", true},
	{"#", "sport/tennis", true},
	{"#", "/", true},
	{"#", "/finance", true},
	{"/#", "/", true},
	{"/#", "/finance", true},
	{"/#", "finance", false},
	{"+/#", "sport", true},
	{"+/#", "sport/tennis/player1", true},
	{"+/tennis/#", "sport/tennis/player1/ranking", true},
	{"+/tennis/#", "sport/tennis", true},
	{"+/tennis/#", "sport/golf", false},

	// [MQTT-4.7.1-2] '+' matches exactly one level, which may be empty.
	{"sport/tennis/+", "sport/tennis/player1", true},
	{"sport/tennis/+", "sport/tennis/player2", true},
	{"sport/tennis/+", "sport/tennis/player1/ranking", false},
	{"sport/+", "sport", false},
	{"sport/+", "sport/", true},
	{"+", "sport", true},
	{"+", "/finance", false},
	{"+/+", "/finance", true},
	{"/+", "/finance", true},
	{"+/+", "a/b/c", false},
	{"+/+/+", "a/b/c", true},
	{"sport/+/player1", "sport/tennis/player1", true},
	{"sport/+/player1", "sport//player1", true},
	{"sport/+/player1", "sport/tennis/player2", false},
	{"+/+", "/", true},
	{"+", "/", false},
	{"a/+/+", "a//", true},
	{"+/b/+", "a/b", false},

	// [MQTT-4.7.2-1] filters starting with a wildcard do not match '$' topics.
	{"#", "$SYS", false},
	{"#", "$SYS/broker/uptime", false},
	{"#", "$", false},
	{"+/monitor/Clients", "$SYS/monitor/Clients", false},
	{"+", "$SYS", false},
	{"+/#", "$SYS/x", false},
	{"$SYS/#", "$SYS/monitor/Clients", true},
	{"$SYS/#", "$SYS", true},
	{"$SYS/monitor/+", "$SYS/monitor/Clients", true},
	{"$SYS/+/Clients", "$SYS/monitor/Clients", true},
	{"$/#", "$/x", true},
	{"a/+", "a/$b", true},
	{"a/#", "a/$b/c", true},
	{"/+", "/$x", true},
	{"+", "x$", true},

	// [MQTT-4.7.3-4] no normalisation: byte-for-byte comparison.
	{"ACCOUNTS", "Accounts", false},
	{"Accounts payable", "Accounts payable", true},
	{"caf\u00e9", "cafe\u0301", false},
	{"caf\u00e9", "caf\u00e9", true},
	{"a/b", "a/b/", false},
	{"a/b/", "a/b", false},
	{"a//b", "a/b", false},
	{"a//b", "a//b", true},
	{"/finance", "finance", false},
	{"a/b", "a/b", true},
	{"a", "ab", false},
	{"ab", "a", false},
	{"a/+/#", "a", false},
	{"a/+/#", "a/b", true},
}

type validateCase struct {
	name   string
	input  string
	limits Limits
	asName error // ValidateName result
	asFilt error // ValidateFilter result
}

var validateCases = []validateCase{
	{"plain", "sport/tennis/player1", Limits{}, nil, nil},
	{"single_level", "a", Limits{}, nil, nil},
	{"empty_levels", "a//b", Limits{}, nil, nil},
	{"leading_slash", "/finance", Limits{}, nil, nil},
	{"trailing_slash", "finance/", Limits{}, nil, nil},
	{"only_slash", "/", Limits{}, nil, nil},
	{"only_slashes", "///", Limits{}, nil, nil},
	{"space", "Accounts payable", Limits{}, nil, nil},
	{"dollar_sys", "$SYS/broker/uptime", Limits{}, nil, nil},
	{"unicode", "日本/caf\u00e9/\U0001F600", Limits{}, nil, nil},
	// [MQTT-1.5.4-3] a BOM is an ordinary character, not skipped.
	{"bom", "\ufeffa", Limits{}, nil, nil},
	{"replacement_char", "\ufffd", Limits{}, nil, nil},
	{"max_scalar", "\U0010FFFD", Limits{}, nil, nil},

	// [MQTT-4.7.3-1] at least one character.
	{"empty", "", Limits{}, ErrEmpty, ErrEmpty},

	// [MQTT-1.5.4-1] well-formed UTF-8, no surrogates.
	{"bad_byte", "a/\xff", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},
	{"truncated", "a\xe6\x97", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},
	{"overlong_slash", "a\xc0\xafb", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},
	{"overlong_nul", "\xc0\x80", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},
	{"surrogate_high", "\xed\xa0\x80", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},
	{"surrogate_low", "x\xed\xbf\xbf", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},
	{"beyond_max", "\xf4\x90\x80\x80", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},

	// [MQTT-1.5.4-2] [MQTT-4.7.3-2] no U+0000.
	{"nul", "a\x00b", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"nul_only", "\x00", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	// MQTT 5.0 section 1.5.4: control characters and non-characters may be
	// treated as malformed.
	{"c0_control", "a\x01", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"tab", "a\tb", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"newline", "a/\n", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"del", "\x7f", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"c1_control", "a\u0085", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"c1_last", "\u009f", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"after_c1", "\u00a0", Limits{}, nil, nil},
	{"noncharacter_fdd0", "\ufdd0", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"noncharacter_fdef", "\ufdef", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"noncharacter_fffe", "\ufffe", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"noncharacter_ffff", "a/\uffff", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"noncharacter_plane1", "\U0001FFFE", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"noncharacter_plane16", "\U0010FFFF", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},

	// [MQTT-3.3.2-2] no wildcards in names; [MQTT-4.7.1-1] '#' whole last
	// level; [MQTT-4.7.1-2] '+' whole level.
	{"hash", "#", Limits{}, ErrWildcardInName, nil},
	{"hash_last", "sport/tennis/#", Limits{}, ErrWildcardInName, nil},
	{"hash_after_slash", "/#", Limits{}, ErrWildcardInName, nil},
	{"hash_after_empty", "a//#", Limits{}, ErrWildcardInName, nil},
	{"hash_glued", "sport/tennis#", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"hash_not_last", "sport/tennis/#/ranking", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"hash_first_not_last", "#/a", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"hash_then_slash", "a/#/", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"hash_prefix", "a/#b", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"hash_double", "##", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"plus", "+", Limits{}, ErrWildcardInName, nil},
	{"plus_first", "+/tennis/#", Limits{}, ErrWildcardInName, nil},
	{"plus_middle", "sport/+/player1", Limits{}, ErrWildcardInName, nil},
	{"plus_last", "sport/+", Limits{}, ErrWildcardInName, nil},
	{"plus_all", "+/+/+", Limits{}, ErrWildcardInName, nil},
	{"plus_empty_levels", "/+/", Limits{}, ErrWildcardInName, nil},
	{"plus_glued_after", "sport+", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"plus_glued_before", "+sport", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"plus_inside", "sport/te+nnis", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"plus_double", "++", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"plus_hash", "+#", Limits{}, ErrWildcardInName, ErrInvalidWildcard},

	// [MQTT-4.7.3-3] at most 65,535 bytes; Limits.
	{"length_at_limit", "abc", Limits{MaxLength: 3}, nil, nil},
	{"length_over_limit", "abcd", Limits{MaxLength: 3}, ErrTooLong, ErrTooLong},
	{"length_counts_bytes", "\u00e9\u00e9", Limits{MaxLength: 3}, ErrTooLong, ErrTooLong},
	{"levels_at_limit", "a/b", Limits{MaxLevels: 2}, nil, nil},
	{"levels_over_limit", "a/b/c", Limits{MaxLevels: 2}, ErrTooManyLevels, ErrTooManyLevels},
	{"levels_empty", "//", Limits{MaxLevels: 2}, ErrTooManyLevels, ErrTooManyLevels},
	{"levels_hash", "a/#", Limits{MaxLevels: 2}, ErrWildcardInName, nil},

	// MQTT 5.0 section 4.8.2: shared subscriptions.
	{"share", "$share/g/sport/+", Limits{}, ErrWildcardInName, nil},
	{"share_exact", "$share/consumer1/sport/tennis", Limits{}, nil, nil},
	{"share_hash", "$share/g/#", Limits{}, ErrWildcardInName, nil},
	{"share_dollar_group", "$share/$queue/a", Limits{}, nil, nil},
	{"share_no_group", "$share//a", Limits{}, nil, ErrInvalidShare},                   // [MQTT-4.8.2-1]
	{"share_no_slash", "$share/g", Limits{}, nil, ErrInvalidShare},                    // [MQTT-4.8.2-2]
	{"share_no_filter", "$share/g/", Limits{}, nil, ErrInvalidShare},                  // [MQTT-4.8.2-2]
	{"share_plus_group", "$share/g+/a", Limits{}, ErrWildcardInName, ErrInvalidShare}, // [MQTT-4.8.2-2]
	{"share_hash_group", "$share/#/a", Limits{}, ErrWildcardInName, ErrInvalidShare},  // [MQTT-4.8.2-2]
	{"share_bare_prefix", "$share/", Limits{}, nil, ErrInvalidShare},
	{"share_bad_inner", "$share/g/a#", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
	{"share_nul_inner", "$share/g/\x00", Limits{}, ErrDisallowedCodePoint, ErrDisallowedCodePoint},
	{"share_bad_group", "$share/\xff/a", Limits{}, ErrInvalidUTF8, ErrInvalidUTF8},
	{"share_levels_inner", "$share/g/a/b", Limits{MaxLevels: 2}, ErrTooManyLevels, nil},
	{"share_levels_over", "$share/g/a/b/c", Limits{MaxLevels: 2}, ErrTooManyLevels, ErrTooManyLevels},
	{"share_word", "$share", Limits{}, nil, nil},
	{"share_lookalike", "$shared/g/a", Limits{}, nil, nil},
	{"queue", "$queue/sport/#", Limits{}, ErrWildcardInName, nil},
	{"queue_empty", "$queue/", Limits{}, nil, ErrInvalidShare},
	{"queue_word", "$queue", Limits{}, nil, nil},
	{"queue_bad_inner", "$queue/+x", Limits{}, ErrWildcardInName, ErrInvalidWildcard},
}

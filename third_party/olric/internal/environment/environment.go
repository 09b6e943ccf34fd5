// Copyright 2018-2022 Burak Sezer
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

package environment

import "sync"

type Environment struct {
	sync.RWMutex

	m map[string]interface{}
}

func New() *Environment {
	return &Environment{
		m: make(map[string]interface{}),
	}
}

func (e *Environment) Get(key string) interface{} {
	e.RLock()
	defer e.RUnlock()

	value, ok := e.m[key]
	if ok {
		return value
	}
	return nil
}

func (e *Environment) Set(key string, value interface{}) {
	e.Lock()
	defer e.Unlock()

	e.m[key] = value
}

func (e *Environment) Clone() *Environment {
	e.RLock()
	defer e.RUnlock()

	f := New()
	for key, value := range e.m {
		f.Set(key, value)
	}
	return f
}
